"""Python client for the radixcache worker (installed as radixcache.client). Never imports torch."""
