"""Joint-finetune mode: encoders re-attached from a store's records, run live or trained.

``mmcache.train.live.reattach`` is the one place ``train`` imports ``precompute``'s encoders; see its
docstring for the public API.
"""
