"""A trained model as a Diffusers pipeline: exported, drawn from during a run (sample grids), and generate.py's work."""
