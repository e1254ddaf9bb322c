"""Spot-market replays: availability traces, policies side by side (``hetplan spot``)."""
