"""Audits of what a finished run publishes, apart from the mechanisms that make it private
(pipeline/privacy/): `audit` searches every published file, log and artifact for private
text, and `canaries` measures how exposed planted records are. They may read the private
data and rebuild the splits (a stage's code), which no privacy mechanism may."""
