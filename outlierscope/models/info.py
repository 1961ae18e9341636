"""`outlierscope info`: versions, presets with exact parameter counts, data cache and bundled models."""

from __future__ import annotations

import platform


def info_text() -> str:
    import numpy
    import tokenizers
    import torch
    import transformers

    import outlierscope
    from outlierscope.data.hellaswag import hellaswag_path
    from outlierscope.models.fetch import fetch_status
    from outlierscope.models.loading import bundled_specs
    from outlierscope.models.presets import PRESETS

    lines = [
        f"outlierscope {outlierscope.__version__}",
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"tokenizers {tokenizers.__version__}, numpy {numpy.__version__}",
        "",
        "Presets (matched pairs: the Diff model has n_heads/2 differential heads and 4 lambda vectors per layer more):",
        f"  {'preset':<11} {'layers':>6} {'hidden':>6} {'heads':>5} {'head_dim':>8} {'ffn':>5} {'vocab':>6} {'ctx':>5} "
        f"{'transformer params':>19} {'diff params':>12}",
    ]
    for p in PRESETS.values():
        lines.append(
            f"  {p.name:<11} {p.n_layers:>6} {p.hidden_size:>6} {p.n_heads:>5} {p.head_dim:>8} {p.intermediate_size:>5} "
            f"{p.vocab_size:>6} {p.seq_len:>5} {p.n_params('transformer'):>19,} {p.n_params('diff'):>12,}"
        )
    path = hellaswag_path()
    lines += [
        "",
        f"HellaSwag data cache: {path} ({'present' if path.exists() else 'missing: run `outlierscope data fetch`'})",
        f"Bundled models: {', '.join(bundled_specs()) or 'none yet'}",
        "Fetchable models (`outlierscope models fetch NAME`):",
    ]
    for r in fetch_status():
        state = f"fetched: {r['path']}" if r["fetched"] else "not fetched"
        lines.append(f"  {r['name']:<14} {r['requirement']:<22} {r['licence']:<11} {state}")
    return "\n".join(lines)
