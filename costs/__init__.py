"""What training costs: the results file a run writes, and report.py's parts: its inputs, the fit, the step model
it predicts other GPU counts with, its tables, text and figure. Standard library and numpy only (matplotlib inside
the figure's functions): a report reads results files without torch."""
