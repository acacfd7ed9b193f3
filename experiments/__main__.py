"""`python -m experiments`: what is here (run one as `python -m experiments.NAME`)."""
import experiments

print(experiments.__doc__)
