"""MkDocs hooks of the documentation site: tables generated from the library where a page asks for them
(``{{ settings outlierscope.runs.sweep_settings.SweepSettings }}``, ``{{ recipes }}``), and the search index's scope:
the run reports that studies generate are left out (their study page links them), the guide pages come first."""

from __future__ import annotations

import importlib
import re

MARKER = re.compile(r"^\{\{ (settings|recipes)(?: ([\w.]+))? \}\}$", re.M)
STUDIES = ("activations/", "checkpoints/", "linear/", "perplexity/", "recipes/", "reproduction/", "sensitivity/",
           "smollm2/", "suite/", "weights/")  # generated run directories (not in the navigation)
BOOST = {"guide/": 5, "index.md": 5, "develop/": 1.5, "api/": 0.5}  # search weight by page: a task's guide page first


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def settings_table(path: str) -> str:
    """A settings dataclass's fields: the setting, its command-line flag, its default and what it sets."""
    from outlierscope.settings import cli_options

    module, name = path.rsplit(".", 1)
    rows = ["| setting | flag | default | meaning |", "|---|---|---|---|"]
    for o in cli_options(getattr(importlib.import_module(module), name)):
        default = "" if o.default is None else f"`{_cell(o.default)}`"
        rows.append(f"| `{o.name}` | `{o.flag}` | {default} | {_cell(o.help)} |")
    return "\n".join(rows)


def recipes_table() -> str:
    """Every named recipe: its name, its spec's canonical text and what it follows."""
    from outlierscope.quant.specs.recipes import RECIPES
    from outlierscope.quant.specs.spec import QuantSpec

    rows = ["| recipe | spec | follows |", "|---|---|---|"]
    rows += [f"| `{r.name}` | `{_cell(QuantSpec.parse(r.name))}` | {_cell(r.source)} |" for r in RECIPES.values()]
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    src = page.file.src_uri
    search = page.meta.setdefault("search", {})
    if src.startswith(STUDIES) and not src.endswith("README.md"):
        search["exclude"] = True
    for prefix, boost in BOOST.items():
        if src.startswith(prefix):
            search.setdefault("boost", boost)
    return MARKER.sub(lambda m: settings_table(m.group(2)) if m.group(1) == "settings" else recipes_table(), markdown)
