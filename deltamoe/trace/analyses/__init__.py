"""One module per question; each takes the per-rank summaries (and the join) and returns JSON-ready data."""
