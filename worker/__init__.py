"""worker of byteps-espresso."""
