"""deploy of byteps-espresso."""
