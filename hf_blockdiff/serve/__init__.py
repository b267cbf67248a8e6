"""`hf-blockdiff serve`: an OpenAI-compatible HTTP server over a live engine (docs/architecture.md, "Server").

Needs the `serve` extra (`pip install "hf-blockdiff[serve]"`): FastAPI, uvicorn, pydantic and prometheus-client. This
package root imports none of them, so the CLI registers the command without the extra and says which one to install
when it runs.
"""
