"""Code and test comments cite the docs as `docs/<file>.md, "<heading>"`: every such citation names a file of docs/
and a heading that file holds, so renaming or moving a section without its citations fails here."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUOTED = r'\\?"([^"\\]+)\\?"'
SEP = r'\s*(?:#\s*)?'
CITATION = re.compile(rf'docs/(\w+)\.md,{SEP}{QUOTED}((?:\s*(?:,|and){SEP}{QUOTED})*)')
FOLLOWING = re.compile(rf'(?:,|and){SEP}(?!docs/){QUOTED}')


def headings(name: str) -> set[str]:
    path = ROOT / "docs" / f"{name}.md"
    lines = path.read_text().splitlines() if path.exists() else []
    return {line.lstrip("#").strip() for line in lines if re.match(r"#{2,} ", line)}


def heading_text(quoted: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"\n\s*#?", " ", quoted)).strip()


def citations() -> list[tuple[str, str, str]]:
    """(citing file, cited docs file, heading) of every citation in the package, tests, benchmarks and examples."""
    found = []
    for folder in ("hf_blockdiff", "tests", "benchmarks", "examples"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".md", ".sh") or not path.is_file():
                continue
            for m in CITATION.finditer(path.read_text()):
                for heading in [m[2], *FOLLOWING.findall(m[3])]:
                    found.append((str(path.relative_to(ROOT)), m[1], heading_text(heading)))
    return found


def test_every_cited_heading_exists():
    found = citations()
    assert len(found) > 50
    missing = [c for c in found if c[2] not in headings(c[1])]
    assert not missing, missing


def test_a_renamed_heading_is_caught():
    assert "The cache" in headings("architecture") and "The cachet" not in headings("architecture")
    assert heading_text("Kernels and\n    # backends") == "Kernels and backends"
