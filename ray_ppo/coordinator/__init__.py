"""The coordinator: a thin async actor (``actor``, the role's one Ray module) over synchronous state
(``state``), the exactly-once prompt ledger, the prompt feed and experience routing."""
