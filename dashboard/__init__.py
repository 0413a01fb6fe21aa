"""The Streamlit dashboard. It reads the collector's HTTP API only (``dashboard.client``) and
imports nothing else of ours; ``kvwatch dashboard`` runs ``dashboard/app.py``."""
