"""Admission's Redis scripts: one ``.lua`` file and one contract module each.

``admit`` (decide and reserve), ``extend`` (grow a streaming reservation), ``settle``
(commit or release once) and ``claim_unpublished`` (the reserve sweeper's claim); their
numeric codes are in ``codes``.
"""
