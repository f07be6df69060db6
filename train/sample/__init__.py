"""Seeing what a run learned: sampling a DiT (Euler flow matching), decoding latents with the
store's VAE, writing pictures; a VLM's answers about images; used by ``mmtrain sample`` and by
``mmtrain fit`` during training.

- ``sampler``  the Euler sampler, guidance and timestep shift (no I/O);
- ``decode``   VAE decoders matching the store's latent field (TAESD-F2, diffusers AutoencoderKL
               and Wan), verified against the field's encoder fingerprint;
- ``output``   PNGs per prompt and seed, a grid, animated WebP for videos, latents as safetensors;
- ``source``   a trained model from a run folder or an export (with the encoders it trained);
- ``answer``   a VLM's greedy or sampled answers about images, as JSON lines;
- ``during_fit`` samples and a deterministic validation loss every ``sample.every`` steps.
"""
