"""The distributed roles and what passes between them: the typed messages, the coordinator
(a thin actor over synchronous state objects), the maker actor and its weight receiver, the
Ray Train loop with its weight publisher and maker monitor, and the wire (routing, transport)."""
