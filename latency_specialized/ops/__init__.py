"""Op families: public functions, plain-torch references, implementations, plan."""
