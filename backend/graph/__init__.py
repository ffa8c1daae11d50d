"""Graphs: networkx DAGs of computations, and their DOT text for drawing."""
