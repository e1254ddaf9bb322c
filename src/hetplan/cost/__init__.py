"""The one cost model: compute, memory, communication and schedule terms, and estimate()."""
