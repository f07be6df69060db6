"""Joint-finetune mode: encoders re-attached from a store's records, run live or trained.

The encoders come from ``precompute`` through ``mmcache.train.encoding``, the one seam;
``reattach`` (with ``record``: what the store recorded, ``inputs``: their inputs prepared as
encode did) is the public API, in docs/design/train.md, "Joint finetuning: re-attaching a field's encoder".
"""
