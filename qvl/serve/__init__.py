"""The serving side: the page and its tabs, the APIs, the waiting line and the answer cache. Never imports torch."""
