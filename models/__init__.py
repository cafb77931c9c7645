"""The models a run trains, as Composer models built from a model folder: Stable Diffusion's UNets, the diffusion
transformers, what both share, and the kernels past the fast recipe. Imports `datapath/`, `settings/` and `guards/`;
they read a `RunConfig` and never parse flags."""
