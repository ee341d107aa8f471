"""Ray outside the roles: starting a local cluster (``local_cluster``, ``startup``), waiting for it
(``readiness``), Ray Data prompt files (``datasets``), Tune sweeps (``sweep``, ``async_search``) and
every use of Ray's private modules (``ray_private``)."""
