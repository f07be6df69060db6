"""Joint-finetune mode: encoders re-attached from a store's records, run live or trained.

The encoders come from ``precompute`` through ``mmcache.train.encoding``, the one seam;
``reattach``'s docstring has the public API.
"""
