"""mmcache: train multimodal models on cached encoder features.

The checkout's root is the ``mmcache`` package; its three subpackages are the top-level folders:
``featstore`` (the feature store), ``precompute`` (``mmcache encode``) and ``train``
(``mmtrain``). They import each other relatively (``from ..featstore import errors``), in one
direction only: see docs/design/house.md.
"""
