"""Python client for the radixcache worker (installed as radixcache.client). Never imports torch."""

from radixcache.client.chat import Chat
from radixcache.client.client import AsyncClient, Chunk, Client, Completion

__all__ = ["AsyncClient", "Chat", "Chunk", "Client", "Completion"]
