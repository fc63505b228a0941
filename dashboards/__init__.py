"""Streamlit dashboard of CEM Lab experiments. Reads MLflow only; never writes."""
