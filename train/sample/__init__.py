"""Seeing what a run learned, for ``mmtrain sample`` and ``mmtrain fit`` during training.

    sampler       the Euler sampler, guidance and timestep shift (no I/O)
    decode        VAE decoders matching the store's latent field, verified by fingerprint
    output        PNGs per prompt and seed, a grid, animated WebP, latents as safetensors
    source        a trained model from a run folder or an export (with the encoders it trained)
    answer        a VLM's greedy or sampled answers about images, as JSON lines
    during_fit    samples and a deterministic validation loss every ``sample.every`` steps
    generate, command   ``mmtrain sample`` of a DiT; the command's entry points
"""
