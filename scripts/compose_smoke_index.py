"""Write a PEP 503 "simple" index over a folder of downloaded wheels, for a throwaway local index.

`make compose-smoke` builds the image where the CPU torch index is out of reach: it fetches
torch and its dependencies with `pip download` on the host, writes this index beside them and
serves the folder on 127.0.0.1 with `python3 -m http.server`, so the image's
`pip install torch==... --index-url $TORCH_INDEX` installs exactly those files.

    python scripts/compose_smoke_index.py WHEEL_DIR      # writes WHEEL_DIR/simple/...

Every link carries the file's sha256, so pip checks what it installs. Only wheels are listed (pip
download is run with --only-binary there); anything else in the folder is ignored.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import logging
import re
import shutil
from collections import defaultdict
from pathlib import Path

log = logging.getLogger("compose_smoke_index")

MAX_FILES = 500  # a torch download is about twenty files; far more means a wrong folder


def normalize(name: str) -> str:
    """The PEP 503 normalized form of a project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project_of(wheel: Path) -> str:
    """The project a wheel file belongs to (its file name's first field, PEP 427)."""
    return normalize(wheel.name.split("-", 1)[0])


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def page(title: str, links: list[tuple[str, str]]) -> str:
    anchors = "\n".join(f'<a href="{html.escape(href)}">{html.escape(text)}</a><br>' for href, text in links)
    return f"<!DOCTYPE html>\n<html><head><title>{html.escape(title)}</title></head><body>\n{anchors}\n</body></html>\n"


def write_index(folder: Path) -> dict[str, list[str]]:
    """Write folder/simple/index.html and one page per project; return {project: [wheel names]}."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {folder}")
    if len(wheels) > MAX_FILES:
        raise SystemExit(f"{len(wheels)} wheels in {folder}: more than {MAX_FILES}, not a torch download")
    projects: dict[str, list[Path]] = defaultdict(list)
    for wheel in wheels:
        projects[project_of(wheel)].append(wheel)
    simple = folder / "simple"
    if simple.exists():
        shutil.rmtree(simple)
    simple.mkdir()
    for project, files in sorted(projects.items()):
        (simple / project).mkdir()
        links = [(f"../../{f.name}#sha256={sha256_of(f)}", f.name) for f in files]
        (simple / project / "index.html").write_text(page(f"Links for {project}", links), encoding="utf-8")
    root_links = [(f"{project}/", project) for project in sorted(projects)]
    (simple / "index.html").write_text(page("Simple index", root_links), encoding="utf-8")
    return {project: [f.name for f in files] for project, files in projects.items()}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="[compose-smoke index] %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the folder holding the downloaded wheels")
    args = parser.parse_args()
    projects = write_index(args.folder.resolve())
    for project, files in sorted(projects.items()):
        log.info("%s: %s", project, ", ".join(files))
    log.info("index of %d projects written under %s/simple", len(projects), args.folder)


if __name__ == "__main__":
    main()
