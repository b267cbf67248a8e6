"""The library in other workflows: from prompts to completions (`completions`), loading a checkpoint for decoding
(`checkpoint`), prompts split over the processes of a launch (`distributed`), generation at every `Trainer.evaluate`
(`callbacks`) and lm-evaluation-harness (`lm_eval`, needs `pip install lm-eval`). Import the submodule you need;
`hf_blockdiff.BlockDiffusionEvalCallback` is the callback."""
