"""A sequence's state: K/V storage, the selectors' side copies, the KV budget and its manager,
the prefix cache and its files on disk (the map of the package is filled in with its split)."""
