"""Reports built from the collector database: inventory, limits cards, breach assessments."""
