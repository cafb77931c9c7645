"""What a run is settled from: its flags, the presets and recipes, the machine, the model folder's facts, and the
settled `RunConfig`. Nothing here imports torch, Composer, Streaming, Diffusers or Transformers at its top level, so a
mistyped flag or a bad value is answered before any of them loads; nothing here imports from the other folders but
`datapath`'s facts (a dataset's index, the tokenizers' ids)."""
