"""Sphinx configuration of hvdtrain's documentation site.

Build (what ``make docs`` runs; warnings are errors, every cross-reference must resolve)::

    .venv/bin/python -m sphinx -n -W --keep-going -b html docs docs/_build/html

The tools are pinned in ``requirements/docs.txt`` (``make docs`` installs them into .venv).
Nothing here needs the network: see ``intersphinx_mapping`` below.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # sphinx-argparse imports hvdtrain.cli (numpy only, no Horovod)
sys.path.insert(0, str(DOCS / "_ext"))

from hvdtrain import __version__  # noqa: E402

project = "hvdtrain"
author = "hvdtrain contributors"
copyright = "hvdtrain contributors; Apache-2.0"
release = version = __version__

extensions = [
    "myst_parser",             # Markdown pages
    "sphinx.ext.napoleon",     # Google-style docstrings (Args:, Returns:, Raises:)
    "sphinx.ext.intersphinx",  # links into Python's documentation (offline inventory)
    "autoapi.extension",       # API reference read from the source: Horovod is never imported
    "sphinxarg.ext",           # CLI reference from hvdtrain.cli.build_parser()
    "hvdtrain_docs",           # docs/_ext: benchmark pages from JSON, metrics.json schema
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = [
    "_build",
    "_ext",
    "_inventories",
    "gpu-check",  # raw evidence files (text) of `make gpu-check`, linked from stack.md
    "reference/generated",  # tables that reference pages {include} (docs/_ext/schema_pages.py)
    "**/README.md",
]
nitpicky = True

# ---- Markdown ----------------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist", "fieldlist", "attrs_inline"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links resolve
myst_links_external_new_tab = False

# ---- API reference (sphinx-autoapi) ------------------------------------------------------------
autoapi_type = "python"
autoapi_dirs = [str(ROOT / "hvdtrain")]
autoapi_root = "reference/api"       # generated at build time; docs/.gitignore keeps it out of git
autoapi_add_toctree_entry = False    # reference/index.md lists it
autoapi_keep_files = False
autoapi_member_order = "groupwise"
# imported-members: the names a package re-exports in __all__ (hvdtrain.torch.distribute, ...)
autoapi_options = [
    "members", "undoc-members", "show-inheritance", "show-module-summary", "imported-members",
]
autoapi_python_class_content = "both"  # the class docstring and __init__'s
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # "Attributes:" as fields: autoapi documents the attributes themselves

# ---- links to other projects' documentation ----------------------------------------------------
# intersphinx reads each project's objects.inv. The build must not need the network (CI and these
# machines reach package registries only), so the inventory is a file kept in docs/_inventories:
# python.inv is Python 3.11's own, from Debian's python3.11-doc package
# (/usr/share/doc/python3.11/html/objects.inv; refresh: `apt-get download python3.11-doc`,
# `dpkg-deb -x`). NumPy, PyTorch, Keras and TensorFlow publish their inventories only on their
# web sites (Keras and TensorFlow publish none at all), so names from them are not links: they
# are listed in nitpick_ignore_regex below as external. Where the network is there,
# HVDTRAIN_DOCS_ONLINE=1 also reads NumPy's and PyTorch's inventories from their sites, so that
# their names become links (the default build needs no network: CI reaches package registries
# only).
intersphinx_mapping = {
    "python": ("https://docs.python.org/3", str(DOCS / "_inventories" / "python.inv")),
}
if os.environ.get("HVDTRAIN_DOCS_ONLINE") == "1":
    intersphinx_mapping["numpy"] = ("https://numpy.org/doc/stable/", None)
    intersphinx_mapping["torch"] = ("https://docs.pytorch.org/docs/stable/", None)
intersphinx_timeout = 5

# Names that belong to other projects without an offline inventory (see above): numpy.ndarray,
# torch.nn.Module, keras.Model, horovod.common.elastic.ObjectState, ray.train.backend.Backend,
# lightning.pytorch.strategies.ParallelStrategy, ... in the code's annotations and docstrings are
# shown as code, not links. Anything else that does not resolve fails the build.
nitpick_ignore_regex = [(r"py:.*", r"(numpy|torch|keras|tensorflow|horovod|ray|lightning)\..+")]

# ---- HTML --------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"hvdtrain {release}"
html_static_path: list[str] = []
html_show_sourcelink = False
html_copy_source = False
pygments_style = "sphinx"

# ---- optional pages ----------------------------------------------------------------------------
# index.md lists every page through glob toctrees, so a page that is not written yet is simply
# absent. Sphinx warns "toctree glob pattern ... didn't match any documents" without a warning
# type, which suppress_warnings cannot name; this drops that one message (and nothing else).


class _EmptyGlobFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "subtype", None) != "empty_glob"


logging.getLogger("sphinx.sphinx.directives.other").addFilter(_EmptyGlobFilter())
