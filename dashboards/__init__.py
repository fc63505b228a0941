"""Streamlit dashboard of CEM Lab experiments. Reads MLflow and the ledger only; never writes."""
