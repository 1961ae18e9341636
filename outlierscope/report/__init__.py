"""Reading result directories back (``load_run``), tables, figures and the markdown report."""
