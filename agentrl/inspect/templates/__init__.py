"""The report page's Jinja2 templates. A package (empty) so that setuptools ships the folder as
package data without warning that it would be ignored."""
