"""The documentation a user reads first: README.md and docs/*.md.

Every relative link (and #anchor, with GitHub's heading slugs) must resolve, every page under docs/ must be
reachable from the README's map, the README must start with the two commands for a fresh machine, and it must
stay short enough to read on a few screens (the reference lives under docs/).
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set:
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def test_every_relative_link_and_anchor_resolves():
    problems = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                problems.append(f"{page.relative_to(ROOT)}: link to {target}: {path} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{page.relative_to(ROOT)}: link to {target}: no heading with anchor #{anchor}")
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_in_the_readme_map():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme]
    assert not missing, f"docs pages not linked from README.md: {missing}"


def test_readme_starts_with_the_two_commands_and_fits_a_few_screens():
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1:lines.index("```")]
    assert block[0].startswith("scripts/setup && build/trainer --config configs/tiny-t5.json"), block
    assert block[1].startswith("scripts/test"), block
    assert len(block) == 2, block
    assert lines.index("```bash") < 5, "the two commands come first"
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move reference material to docs/"


def test_readme_does_not_point_outside_the_project():
    for page in PAGES:
        assert "../shared" not in page.read_text(), f"{page.relative_to(ROOT)} links outside the repository"
