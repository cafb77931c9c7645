"""What training costs: the results file a run writes, and the step model report.py predicts other GPU counts with.
Standard library and numpy only: a report reads results files without torch."""
