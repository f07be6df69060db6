"""The data side of the trainer: which samples, in what order, cut into balanced steps.

    stream      FeatureStream: a store's features streamed into steps, read a few steps ahead
    selection   which samples a stream trains on (listed), and StreamOptions
    positions   a dense store by position: sized per shard when a step first touches it
    order       the shard-aware epoch order's window, sized from the cache
    sources     data.sources: several stores as one (StoreMix) and their mixed order
    manifest    training on a manifest's rows: samples not in the store, encoded live
    balance     token-cost-balanced batches over the data-parallel ranks, micro-batches
    packing     VLM samples packed whole into rows with a block-diagonal causal mask
"""
