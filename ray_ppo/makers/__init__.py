"""The experience makers: the maker actor (``worker``, the role's one Ray module), making experience
(``experience``: generate, score, advantages), multi-turn episodes (``episodes``), the vLLM engine,
the weight receiver, held-out evaluation, and the stand-in makers tests use (``testing``)."""
