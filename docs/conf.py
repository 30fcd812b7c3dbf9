"""Sphinx configuration of the shardwise docs: `make docs` builds them with warnings as errors."""

from __future__ import annotations

import shardwise

project = "shardwise"
author = "the shardwise authors"
copyright = "the shardwise authors, BSD-3-Clause"
release = shardwise.__version__
version = release

extensions = [
    "myst_parser",  # the pages are markdown, as they read on GitHub
    "sphinx.ext.autodoc",  # the API reference comes from the docstrings
    "sphinx.ext.viewcode",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Docstrings write `name` for code, as markdown does.
default_role = "code"

# Links like [Commit protocol](format.md#commit-protocol) resolve to headings.
myst_heading_anchors = 3

autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "signature"
# Signatures name classes as users import them (`shardwise.Layout`), not their home modules.
autodoc_typehints_format = "short"
autodoc_class_signature = "separated"
autodoc_inherit_docstrings = False

html_theme = "furo"
html_title = f"shardwise {release}"
