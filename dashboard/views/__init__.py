"""The dashboard's pages, one script each; ``dashboard/app.py`` registers them with
``st.navigation``."""
