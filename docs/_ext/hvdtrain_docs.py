"""Sphinx extension of hvdtrain's docs (docs/conf.py loads it).

- Short cross-references in the code's docstrings (``:func:`distribute``` written in
  :mod:`hvdtrain.keras.optimizer`) resolve to the object of that name nearest to the module they
  are written in (:func:`resolve_short_name`): Python's domain resolves a bare name only inside
  its own module and class.
- A reference to a private name, or to a name its module leaves out of ``__all__``, is shown as
  code without a link (the reference does not document it); a name the source does not define
  is still an error.
- ``hvdtrain.keras.callbacks``, the function that :mod:`hvdtrain.keras` re-exports, shares its
  name with the module :mod:`hvdtrain.keras.callbacks`: the API reference keeps the module.
- The benchmark pages (docs/benchmarks/generated/) are written from benchmarks/results/*.json
  before the sources are read (:mod:`benchmark_pages`), and the ``metrics.json`` schema table
  from the dataclass that declares it (:mod:`schema_pages`).
"""
from __future__ import annotations

from pathlib import Path

from sphinx.util import logging
from sphinx.util.nodes import make_refnode

import benchmark_pages
import schema_pages

log = logging.getLogger(__name__)
DOCS = Path(__file__).resolve().parent.parent
ROOT = DOCS.parent


def _common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def resolve_short_name(target: str, here: str, names: list[str]) -> str | None:
    """The documented name that ``target`` means when written in module ``here``.

    Among ``names`` ending in ``.target`` (or equal to it), the one sharing the longest leading
    part with ``here``; among those, the shortest (a package's re-export,
    ``hvdtrain.torch.distribute``, over its defining module's
    ``hvdtrain.torch.adapter.distribute``).
    None when there is none, or when two different names of the same length tie (ambiguous: the
    docstring has to say which).
    """
    target = target.lstrip("~.")
    found = [n for n in names if n == target or n.endswith("." + target)]
    if not found:
        return None
    parts = here.split(".") if here else []
    best = max(_common_prefix(n.split("."), parts) for n in found)
    found = [n for n in found if _common_prefix(n.split("."), parts) == best]
    shortest = min(len(n.split(".")) for n in found)
    found = [n for n in found if len(n.split(".")) == shortest]
    return found[0] if len(found) == 1 else None


def _missing_reference(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    domain = env.get_domain("py")
    target = node.get("reftarget", "").lstrip("~.")
    here = node.get("py:module") or ""
    if node.get("py:class"):
        here = f"{here}.{node['py:class']}" if here else node["py:class"]
    if not (here.startswith("hvdtrain") or target.startswith("hvdtrain")):
        return None
    kinds = set(domain.objtypes_for_role(node.get("reftype", "")) or ())
    names = [name for name, entry in domain.objects.items()
             if name.startswith("hvdtrain") and entry.objtype in kinds]
    name = resolve_short_name(target, here, names)
    if name is None and "." in target:
        # hvdtrain.keras.adapter.ranks_where (imported there from elsewhere), hf.HostfileError
        # (a module imported as hf): the name as seen from that module.
        prefix, _, last = target.rpartition(".")
        name = resolve_short_name(last, prefix if prefix.startswith("hvdtrain") else here, names)
    if name is None:
        # A name the source defines but the reference leaves out (not in its module's __all__):
        # shown as code, without a link. A name the source does not define still fails.
        defined = [n for n in getattr(env, "autoapi_all_objects", {}) if n.startswith("hvdtrain")]
        if resolve_short_name(target, here, defined) is not None:
            return contnode
        return None
    entry = domain.objects[name]
    return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, name)


def summary(docstring: str) -> str:
    """The API tables' one-line summary of a docstring: its first sentence (the first paragraph
    up to the first ". " outside inline code), where autoapi takes the first line, which cuts
    ````code`` spanning two lines`` in half."""
    para = " ".join(docstring.strip().split("\n\n", 1)[0].split())
    start = 0
    while True:
        cut = para.find(". ", start)
        if cut < 0:
            return para
        head = para[:cut + 1]
        balanced = head.count("``") % 2 == 0 and head.replace("``", "").count("`") % 2 == 0
        if balanced and not head.endswith(("e.g.", "i.e.", "etc.", "...")):
            return head
        start = cut + 2


def _skip_member(app, what, name, obj, skip, options):
    # The function hvdtrain.keras.callbacks (re-exported) against the module of that name.
    if what == "function" and name == "hvdtrain.keras.callbacks":
        return True
    return None


def _generate(app):
    benchmark_pages.write_pages(ROOT / "benchmarks", DOCS / "benchmarks" / "generated")
    for problem in schema_pages.write_pages(ROOT, DOCS / "reference" / "generated"):
        log.warning(problem, type="hvdtrain", subtype="schema")


def setup(app):
    from autoapi import _objects  # pinned (requirements/docs.txt); its summary is a property
    _objects.PythonObject.summary = property(lambda self: summary(self.docstring or ""))
    app.connect("builder-inited", _generate)
    app.connect("missing-reference", _missing_reference)
    app.connect("autoapi-skip-member", _skip_member)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
