"""mkdocs hook: the README is the site's home page, with its links into docs/ made relative to the site."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

README = Path(__file__).resolve().parents[1] / "README.md"


def on_files(files: Files, config) -> Files:
    text = re.sub(r"\]\(docs/", "](", README.read_text(encoding="utf-8"))
    files.append(File.generated(config, "index.md", content=text))
    return files
