"""The report page's own CSS and JS, inlined into it. A package (empty) so that setuptools ships the
folder as package data without warning that it would be ignored."""
