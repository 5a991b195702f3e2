package boxcore

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// Only a server that cannot be reached is refused: a closed port, silence (a name that does
// not resolve too, not probed here: tests send nothing off the machine, DNS included); any HTTP answer (even an error status) lets the daemon decide.
func TestCheckImageServer(t *testing.T) {
	ctx := context.Background()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := l.Addr().String()
	l.Close()
	silent, err := net.Listen("tcp", "127.0.0.1:0") // accepts, never answers
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	answering := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { http.NotFound(w, r) }))
	defer answering.Close()

	old := probeTimeout
	probeTimeout = 500 * time.Millisecond
	defer func() { probeTimeout = old }()
	for _, tc := range []struct {
		server, protocol, want string
	}{
		{"https://" + closed, "simplestreams", "connection refused"},
		{"https://" + closed, "incus", "connection refused"},
		{"http://" + silent.Addr().String(), "simplestreams", "no answer within 500ms"},
		{answering.URL, "simplestreams", ""},
		{answering.URL, "incus", ""},
	} {
		err := checkImageServer(ctx, "r:debian/12", incus.InstanceSource{Server: tc.server, Protocol: tc.protocol})
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s (%s) answers, yet: %v", tc.server, tc.protocol, err)
		case tc.want != "" && (err == nil || !IsUsage(err) || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "claudebox image build")):
			t.Errorf("%s (%s): %v, want a usage error with %q", tc.server, tc.protocol, err, tc.want)
		}
	}
}

func TestFirstBootTextNamesTheTemplate(t *testing.T) {
	if got := firstBootText("w", "blank"); !strings.Contains(got, "the blank template's first boot") || strings.Contains(got, "Claude") {
		t.Errorf("blank: %q", got)
	}
	if got := firstBootText("w", ""); !strings.Contains(got, "first boot") {
		t.Errorf("no template: %q", got)
	}
}
