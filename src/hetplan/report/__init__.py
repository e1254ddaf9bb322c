"""Reports: rich tables, Chrome traces, timeline pictures, exports."""
