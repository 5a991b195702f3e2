package incus

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"gopkg.in/yaml.v3"
)

// builtinImageRemotes are the image servers the incus CLI knows without any config.
var builtinImageRemotes = map[string]cliConfigRemote{
	"images": {Addr: "https://images.linuxcontainers.org", Protocol: "simplestreams", Public: true},
}

// ImageRemote returns the address and protocol of an image remote named in the incus CLI's
// config (or a built-in one such as "images"). An unknown name gives *UnknownRemoteError.
func ImageRemote(name string) (addr, protocol string, err error) {
	cfgPath := filepath.Join(ConfigDir(), "config.yml")
	var cfg cliConfig
	b, err := os.ReadFile(cfgPath)
	switch {
	case err == nil:
		if err := yaml.Unmarshal(b, &cfg); err != nil {
			return "", "", fmt.Errorf("incus: parsing %s: %w", cfgPath, err)
		}
	case !errors.Is(err, os.ErrNotExist):
		return "", "", fmt.Errorf("incus: reading %s: %w", cfgPath, err)
	}
	r, ok := cfg.Remotes[name]
	if !ok {
		r, ok = builtinImageRemotes[name]
	}
	if !ok {
		return "", "", &UnknownRemoteError{Name: name, Config: cfgPath}
	}
	protocol = r.Protocol
	if protocol == "" {
		protocol = "incus"
	}
	return r.Addr, protocol, nil
}
