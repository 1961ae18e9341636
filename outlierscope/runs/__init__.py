"""Experiments built on the layers below: profile (Table 5), sweep (Figure 8, any task), sensitivity (per layer)
and reproduce (profile + sweep + report), each with a settings dataclass and a result that saves itself."""
