"""What a run is settled from: its flags, the presets and recipes, the machine, the model folder's and the dataset's
facts, the tokenizers' ids, and the settled `RunConfig`. Imports `guards/` alone of the repo, and no torch,
Composer, Streaming, Diffusers or Transformers at a module's top level: a mistyped flag or a bad value is answered
before any of them loads."""
