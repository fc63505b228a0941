"""Training a plan: the stages of a submission (``run``), Ray Tune over Ray Train in packs of
same-shaped trials (``launch``, ``packs``, ``settle``), the leases on the trials it trains
(``leases``), one trial in this process (``local_trial``) and a host joining the cluster
(``join``)."""
