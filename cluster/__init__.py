"""radixcache on Ray Serve: N engine replicas behind one endpoint, routed by exact cached prefix.

Imported only by `radixcache cluster` (and tests); needs the `cluster` extra (ray[serve]). The worker never imports it.
"""
