"""WebShop (Yao et al., 2022) on the "small" 1,000-product catalogue: pages, BM25 search, goals and reward.

Modules: ``catalogue`` (products, seeded prices, synthetic/human goals, fixed splits), ``search`` (BM25 over the
products' ``contents``), ``reward`` (the original attribute/option/price/type reward), ``pages`` (the text of each page
and its clickables), ``env`` (``WebShopEnv``, the ``TextEnv``).
"""
