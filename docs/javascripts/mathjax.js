// MathJax settings. They must run before `assets/mathjax/tex-chtml.js` (the copy that docs/hooks/mathjax.py
// adds to the site), so this file comes first in `extra_javascript`.
//
// pymdownx.arithmatex, in its generic mode, writes inline math as \( ... \) and display math as \[ ... \] inside
// elements of class "arithmatex"; MathJax looks there and nowhere else.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};

// MathJax typesets each page once, when it loads. The theme's `navigation.instant` feature (off in mkdocs.yml)
// would swap pages without a reload, and would need a re-typeset after every swap.
